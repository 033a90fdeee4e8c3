"""The Vflash node pack (installed and imported as `vflash_nodes`): everything that knows about ComfyUI graphs.

* `actions`: what each node does, host-neutral (no ComfyUI import): the ComfyUI nodes and the headless runner both
  call it; `engines` (specs, the engine registry, compile on first use), `model_files` (the loaders' options and
  their identity), `request_inputs` (the encode widgets as the pipeline's values), `core_adapters` (core's CLIP and
  VAEs behind Vflash's interfaces), `graph_checks` (refusals read from a queued graph) and `interfaces` (what the
  actions need of a host) beneath it; `comfy_latent`: ComfyUI's tensor layouts <-> Vflash's; `workflow`,
  `cli_workflow`: API-format workflows run without ComfyUI (`vflash run-workflow`).
* `extension`, `loaders`, `generation`, `host`, `registry`, `types`: the V3 nodes, thin (widgets in, one `actions`
  call, wrapping out); they import `comfy_api` and run only inside ComfyUI or over `headless`, the ComfyUI interface
  `run-workflow` and the tests install in their own process.

`vflash_core` never imports this package.
"""
