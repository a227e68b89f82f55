"""Measuring for `fulcrum plan`: this machine at a model's shapes (`machine`), and the engine's own speed
(`engine_speed`). plan itself is arithmetic on configs; it gets these numbers as data."""
