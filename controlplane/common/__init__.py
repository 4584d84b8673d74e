"""The house's shared vocabulary, imported by every layer and importing none of them: id and
name patterns (`names`), the pool lock and the one lock order (`locks`), and the mapping of
domain errors to gRPC status that both servers use (`status`)."""
