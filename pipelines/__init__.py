"""Pipeline adapters: one `StochasticPolicy` per file, imported as ``mmgrpo.pipelines.<name>``."""
