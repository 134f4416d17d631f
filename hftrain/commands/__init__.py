"""One module per `hftrain` command. Each exposes ``add_parser(subparsers)`` (its options and help) and
``run(args, overrides) -> exit code``; ``TAKES_OVERRIDES = False`` where `key=value` words are plain values.

Command modules may import library modules, never the other way round (tests/test_structure.py).
"""
