"""The shfx runtime: host store, device slot pool, backends, interpreter, host optimizer."""
