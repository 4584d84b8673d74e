"""Developer tooling, apart from the domain: `better-compute dev` (the whole system on one machine)
and the process runner it, the tests and the benchmarks start real processes with."""
