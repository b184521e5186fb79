"""Prefill/decode disaggregation: the engine-side connector (hold, push, reserve, admit) and the instance-side
HTTP glue that lets a decode instance drive a prefill instance."""
