"""The port `fulcrum serve` binds: the connections it accepts have Nagle's algorithm off (TCP_NODELAY), as asyncio
sets it on TCP sockets. With it on, a whole answer (headers, then body, two writes) on a keep-alive connection
waited for the client's delayed ACK, about 40 ms, and so did streamed chunks."""

from __future__ import annotations

import asyncio
import socket

from fulcrum.server.launch import bind_port


def test_accepted_connections_send_without_delay():
    async def main() -> int:
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()

        async def on_connect(reader, writer):
            sock = writer.get_extra_info("socket")
            accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        sock = bind_port("127.0.0.1", 0)
        server = await asyncio.start_server(on_connect, sock=sock)
        port = sock.getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        nodelay = await asyncio.wait_for(accepted, 10)
        writer.close()
        server.close()
        await server.wait_closed()
        return nodelay

    assert asyncio.run(main()) == 1
