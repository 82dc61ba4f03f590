"""dmuon: owner-centric distributed Muon for PyTorch FSDP2."""
