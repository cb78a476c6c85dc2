"""Native torch.distributed elastic training with the PolluxAgent."""
