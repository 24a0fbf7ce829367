"""Torch-free, Ray-free types shared by every pdserve package."""
