"""`strata bench`: the benchmarks, a module each (dequant, kernels, model, ple, serve)."""

# `strata bench kernels`' formats by default, the decode path's: here, so that the command
# line's help lists them without importing torch
TABLE_FORMATS = ("Q8_0", "Q4_0", "Q4_K", "IQ4_NL", "IQ3_S", "IQ3_XXS")
