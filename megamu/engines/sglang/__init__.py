"""SGLang servers as a rollout engine: the HTTP client (client.py), launching and stopping servers (launch.py, nodes.py
for several nodes), weight syncs (weight_sync.py), their memory around training (memory.py), the CPU build's launch
settings (cpu_build.py). Nothing of SGLang is imported here: servers are separate processes."""
