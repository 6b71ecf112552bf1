"""Process-level helpers every part may use, importing nothing else of megamu but megamu.errors: the device
(``device``), torch.distributed and the parallel groups (``parallel``), free ports (``net``), atomic files and
directory removal (``atomic``) and fault injection for the crash tests (``faults``)."""
