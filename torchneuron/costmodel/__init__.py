"""The Trainium performance and cost model (docs/costmodel.md): ops (pure op costs), trace (a model's step on
meta tensors), estimate (torchneuron.estimate), report (Markdown, charts, HTML), presets (models from Hugging
Face configs), validation (against published measurements), cli (the estimate and profile subcommands).
Nothing is imported here: `import torchneuron` stays light."""
