"""The store and the live-rescale rendezvous (installed as ``pollux_launch.rendezvous``)."""
