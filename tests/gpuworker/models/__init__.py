"""Tests of gpuworker/models and the reference attention backend."""
