"""The simulator: the engine's own scheduler, block pool and core on a virtual clock, each step priced by
a cost model fitted to steps timed on a GPU (``pagedserve calibrate``), so a ladder runs without one."""
