"""SGLang servers as a rollout engine: the HTTP client (client.py), launching and stopping servers (launch.py, nodes.py
for several nodes), weight syncs (weight_sync.py), their memory released and resumed around training
(memory_saver.py). The CPU build's launch settings, for the real-server tests and benches, are
tests/sglang_real/cpu_build.py's. Nothing of SGLang is imported
here: servers are separate processes."""
