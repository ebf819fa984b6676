"""Put kvobs on real engines: one module per engine (`vllm`, `sglang`, `fastdeploy`), each importing its engine
lazily, so `import kvobs` never imports an engine and each integration works only where its engine is installed.
Every integration returns or exposes an undo."""
