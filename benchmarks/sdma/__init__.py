"""SDMA's benchmarks: ``sdma-bench`` (FLOPs, step timing, scaling), the GPU speed run, the kernel benchmark and
compile report, the update profile."""
