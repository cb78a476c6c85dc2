"""Framework adapters: torch, horovod, deepspeed (installed as pollux_launch.adapters)."""
