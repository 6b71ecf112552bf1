"""A stand-in for the ``sglang`` package, put first on PYTHONPATH of a launched "server" by launcher tests: its
``launch_server`` serves the schema server (tests/engines/schema_server.py) with the flags SGLang's would take."""
