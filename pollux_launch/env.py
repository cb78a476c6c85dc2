"""The environment a job's processes are started with: the one definition of each name.

Set by the node agent (``pollux_launch.launcher.drivers``) for every worker, read by the
rendezvous, the adapters and the agent. The torch variables (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) are torchrun's
contract and keep torchrun's meaning.
"""

from __future__ import annotations

STORE = "POLLUX_STORE"  # the store URL (never with a password: see store.cli_args)
PREFIX = "POLLUX_STORE_PREFIX"  # the cluster's key prefix
DEFAULT_PREFIX = "/pollux"
# How a job's processes reach an etcd with TLS and authentication: the CA and client
# certificate files, and the job's OWN store user and password file (scoped to the job's
# keys by its node agent: ``Store.scoped_credentials``), never the operator's.
STORE_CA_CERT = "POLLUX_STORE_CA_CERT"
STORE_CERT = "POLLUX_STORE_CERT"
STORE_KEY = "POLLUX_STORE_KEY"
STORE_USER = "POLLUX_STORE_USER"
STORE_PASSWORD_FILE = "POLLUX_STORE_PASSWORD_FILE"
JOB = "POLLUX_JOB"  # the job's name
NODE = "POLLUX_NODE"  # the node this worker runs on
WORKER_ID = "POLLUX_WORKER_ID"  # this worker's id, unique in the job
# A random value its node agent gives each worker process (launcher/workers.py): it marks
# the worker's rank announcements on its stdout/stderr (output_marks.py) and tags
# the processes the worker starts, which inherit it (launcher/proctree.py)
WORKER_TOKEN = "POLLUX_WORKER_TOKEN"
ADDR = "POLLUX_ADDR"  # the address peers reach this node at (its agent's --address)
EXIT_FILE = "POLLUX_EXIT_FILE"  # where the worker tells its agent why it is leaving
EXIT_DEPARTED = "departed"  # ...written there: a round formed without it (not completion)
EXIT_JOINED = "joined"  # ...or: it joined its job's group (its failures are the job's)
# The GPU a worker holds (its node agent's claim, launcher/devices.py); its
# CUDA_VISIBLE_DEVICES lists its job's GPUs on the node, this one at LOCAL_RANK
GPUS = "POLLUX_GPUS"
LOG_LEVEL = "POLLUX_LOG_LEVEL"
CHECKPOINT_DIR = "POLLUX_CHECKPOINT_DIR"  # the job's durable checkpoints (pollux-run flag)
CHECKPOINT_INTERVAL = "POLLUX_CHECKPOINT_INTERVAL"  # seconds between them (default below)
DEFAULT_CHECKPOINT_INTERVAL = 60.0
# the job's adaptation policies, comma-separated built-in names or module:attribute
# import paths (pollux-run --policy-module; pollux_launch.elastic.adaptation)
POLICIES = "POLLUX_POLICIES"
# the job's batch-size range (pollux-run --min-batch-size/--max-batch-size): narrows what
# the script allows (pollux_launch.tuning.tuner.batch_range)
MIN_BATCH_SIZE = "POLLUX_MIN_BATCH_SIZE"
MAX_BATCH_SIZE = "POLLUX_MAX_BATCH_SIZE"
# A restart-elastic (or fixed) job's reference size: the world size its global batch is
# written for (pollux-run -np); pollux_launch.constant_batch keeps per-device batch x
# world x accumulation at that size's value when a restart changes WORLD_SIZE
REFERENCE_WORLD_SIZE = "POLLUX_REFERENCE_WORLD_SIZE"
DEEPSPEED_KEEP_STATE = "POLLUX_DEEPSPEED_KEEP_STATE"  # keep engine.restored_state (tests)
# Horovod newcomers started warm (adapters/horovod/launch/warm.py): "0" in the launcher's
# environment turns it off; the zygote's command (JSON); the socket a hand-off reaches it
# at (adapters/horovod/launch/handoff.py repeats this one name: it imports nothing of ours)
HVD_WARM = "POLLUX_HVD_WARM"
HVD_WARM_COMMAND = "POLLUX_HVD_WARM_COMMAND"
HVD_ZYGOTE = "POLLUX_HVD_ZYGOTE"

# Slurm's, read by `pollux-run --slurm` inside an allocation (launcher/slurm_allocation.py)
# and by the node agent that srun starts there (its default node name)
SLURM_JOB_ID = "SLURM_JOB_ID"
SLURM_JOB_NODELIST = "SLURM_JOB_NODELIST"
SLURMD_NODENAME = "SLURMD_NODENAME"
SLURM_JOB_NUM_NODES = "SLURM_JOB_NUM_NODES"
SLURM_CPUS_ON_NODE = "SLURM_CPUS_ON_NODE"  # the job's cores on this node: its CPU slots
SLURM_STEP_ID = "SLURM_STEP_ID"  # set in a task of an srun step, not in the batch script

# The user's state folder (XDG's name; unset or relative: ~/.local/state): a local
# pollux-run keeps its job's output under it (launcher/logs.py: local_log_dir)
STATE_HOME = "XDG_STATE_HOME"

# The operator's secrets, read by pollux-run and its services from their environment
# and NEVER passed on to a job's processes (WorkerGroup strips them): the cluster secret
# signs commands that every node agent runs; the store password opens the whole store.
SECRET = "POLLUX_SECRET"
SECRET_FILE = "POLLUX_SECRET_FILE"
STORE_PASSWORD = "POLLUX_STORE_PASSWORD"
SECRETS = (SECRET, SECRET_FILE, STORE_PASSWORD)


# The transports' own variables, set per node from the interface that carries ADDR
# (pollux_launch.rendezvous.network): gloo, NCCL's bootstrap sockets, Horovod's gloo.
TRANSPORT_IFNAME = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "HOROVOD_GLOO_IFACE")
