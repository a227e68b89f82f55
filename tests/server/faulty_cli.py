"""`fulcrum` with a fault in the model runner, for tests: once a request whose prompt starts with POISON has
two output tokens, every step that holds it fails, as a bug triggered by one request's state would. Run as `python -m tests.server.faulty_cli
serve ...`; the engine-core process, started by multiprocessing's spawn, imports this module again as its
main module, so the fault is in the core where steps run."""

import sys

from fulcrum.cli import main
from fulcrum.engine.model_runner import ModelRunner

POISON = [4, 4, 4]  # token ids
_execute = ModelRunner.execute


def _faulty_execute(self, sched):
    if any(s.request.prompt_token_ids[:3] == POISON and s.request.num_output_tokens >= 2 for s in sched.scheduled):
        raise RuntimeError("injected fault: this request's input breaks the step")
    return _execute(self, sched)


ModelRunner.execute = _faulty_execute

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
