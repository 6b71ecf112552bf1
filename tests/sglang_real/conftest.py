"""The real-server tier (`make test-sglang`): the real SGLang 0.5.23 server on CPU (shared/sglang-cpu), 127.0.0.1 only.

Collected only when MEGAMU_SGLANG_TESTS=1 (set by `make test-sglang`), so `make test` never starts a server; when it is
set, a missing CPU build is an error, never a skip.
"""

import os

if os.environ.get("MEGAMU_SGLANG_TESTS") != "1":
    collect_ignore_glob = ["test_*.py"]
