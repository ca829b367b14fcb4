"""What every HTTP rollout engine (SGLang, vLLM) shares: launching and watching server processes
with port claims (`launcher`), blocking control calls with retries (`transport`), and the
bookkeeping of weight versions and resyncs around an engine-specific load route (`weights`)."""
