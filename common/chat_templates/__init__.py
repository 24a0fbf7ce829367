"""Chat templates shipped with pdserve (data files)."""
