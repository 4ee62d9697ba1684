"""Synthetic run pairs for tests, benchmarks and notebooks (torch-free).

``synth.write_pair`` writes two contract-valid runs through the capture's own shard writer
(``detfp_format.writer.ShardWriter``, manifests and commit logs included) with a planted
difference and returns where a correct bisect must find it. Nothing in the analysis pipeline
imports this package.
"""
