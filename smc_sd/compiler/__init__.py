"""Lowers a program and a schedule to a `StepPlan` with static shapes, checking every input."""

from smc_sd.compiler.plan import StepPlan, compile_program

__all__ = ["StepPlan", "compile_program"]
