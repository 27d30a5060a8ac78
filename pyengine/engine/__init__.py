"""The engine: the LLM entry point, the step loop, the model runner and what it owns (KV and
recurrent-state caches, attention metadata, CUDA graphs). Import the submodules directly; this
package imports nothing, so the ops and models can use its plain data types without a cycle."""
