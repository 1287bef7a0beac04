"""The `shardforge` commands, one module per command (or small group): each gives `add_parser(sub)` and
its handler, so cli.py only assembles the parser."""
