"""The web UI face (`shardforge webui`): forms over the config, runs as subprocesses, chat and export."""
