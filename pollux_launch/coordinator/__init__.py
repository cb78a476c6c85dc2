"""The coordinator: the cluster's scheduling service (Pollux Sec. 4.2 run as a service).

* :mod:`.jobs`         pure: the store's messages of one job in, the policy's ``JobInfo``
  out (the simulator goes through it too)
* :mod:`.service`      the service loop: leadership, rounds, allocations written under a
  fencing term (its docstring states the protocol)
* :mod:`.autoscaler`   grows and shrinks the cluster by Pollux's utility rule
* :mod:`.provisioners` how nodes are added and released (``command``, ``slurm``), by name
* :mod:`.cli`          ``pollux-run coordinator``
"""
