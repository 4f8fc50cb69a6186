"""paratwin executor: runs a schedule for real with torch.distributed."""
