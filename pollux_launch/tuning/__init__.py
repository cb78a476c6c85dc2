"""The goodput tuner inside every job's workers - the paper's PolluxAgent (Pollux Sec. 4.1):
step profile, gradient noise scale, statistical progress, (m, s) and LR decisions, hints.
Named *tuner* here so that "agent" means one thing only: the per-node daemon
(``pollux-run agent``, ``launcher/node_agent.py``)."""
