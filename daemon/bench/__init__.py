"""`tokend bench`: a serving benchmark with vLLM's `bench serve` metrics, against a running daemon."""
