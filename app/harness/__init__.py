"""Local stacks of real engines for ``kv-sidecar demo --engine vllm``, the benches and the tests:
``LocalPD``, its engines' command lines, process trees and tiny models."""
