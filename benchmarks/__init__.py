"""Benchmarks: neuron vs plain PyTorch CPU, run by `make bench`."""
