"""Tests of the GPU worker package (gpuworker/)."""
