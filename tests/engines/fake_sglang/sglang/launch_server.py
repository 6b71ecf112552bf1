"""``python -m sglang.launch_server`` for launcher tests: the schema server on --port with --api-key, for --model-path.

$FAKE_SGLANG_DELAY (seconds) holds every /generate that long, so a test can act while requests are in flight.
It writes its command line and environment to $FAKE_SGLANG_RECORD/<port>.json, so tests can see what megamu passed."""

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.environ["FAKE_SGLANG_REPO"])

from megamu.engines.local import LocalEngine  # noqa: E402
from tests.engines.schema_server import SchemaServer  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--model-path")
ap.add_argument("--port", type=int)
ap.add_argument("--api-key")
args, _ = ap.parse_known_args()
record = Path(os.environ["FAKE_SGLANG_RECORD"]) / f"{args.port}.json"
record.write_text(json.dumps({"argv": sys.argv[1:], "env": dict(os.environ), "pid": os.getpid()}))
server = SchemaServer(LocalEngine(args.model_path), api_key=args.api_key, port=args.port)
server.delay_s = float(os.environ.get("FAKE_SGLANG_DELAY", "0"))
time.sleep(600)  # bounded: a test that forgets to stop it loses it after ten minutes
