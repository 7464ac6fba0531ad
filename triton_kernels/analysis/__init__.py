"""Reading the kernels without a GPU: compiled for sm_90 or gfx942, their machine code
read (static.py: registers, spills, instructions a weight, load widths, matrix
instructions), and a model's launches recorded and compiled for a target (launches.py).
Nothing here runs a kernel."""
