"""Speculative decoding: the config, one module per proposer, the proposer factory, the
draft-length policy and the rejection sampler."""
