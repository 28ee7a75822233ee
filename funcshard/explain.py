"""Explain one rank's training step at scale, without the machines: memory, collectives, time.

    python -m funcshard.explain (--model MODULE:FUNCTION | --hf-config CONFIG)
        [--hf-override K=V,...] [--world N | RxS] [--batch B] [--seq S] [--input-width W]
        [--param-dtype bf16|fp16|fp32] [--reduce-dtype bf16|fp16|fp32] [--policy A,B]
        [--recompute] [--no-reshard | --reshard-to N] [--optimizer adamw|none] [--budget 80GB]
        [--hardware h100|measure] [--no-search] [--json PATH] [--png PATH]

The model is built on the meta device: ``--model pkg.mod:fn`` calls ``fn()`` (an nn.Module);
``--hf-config`` takes a transformers model type (``llama``, its defaults), a JSON object or
``config.json`` with a ``model_type``, or a hub name (online), and ``--hf-override`` sets
fields, e.g. ``--hf-config llama --hf-override hidden_size=4096,num_hidden_layers=32``
(``AutoModelForCausalLM.from_config``). Its float32 parameters are sharded over a fake process
group of ``--world`` ranks (``RxS``: HSDP's replicate x shard mesh) and one rank's step --
forward, the loss (cross-entropy of the logits against ``(batch, seq)`` token ids, or with
``--input-width`` the sum of the output over float inputs), backward, AdamW -- runs on fake
tensors (``fs.explain``): no compute, no communication, seconds on a laptop.

Groups (``--policy``): default, a group per repeated block class (the children of a
ModuleList), the embeddings and the head; or a comma-separated list of module classes or
module names. ``--param-dtype`` is the compute (gather) dtype, ``--reduce-dtype`` the
gradients' reduce-scatter dtype. Times use ``--hardware``: nominal H100 rates, or rates
measured on this machine.

It prints the explanation's table, whether the step fits ``--budget`` per rank at ``--batch``,
and (unless ``--no-search``) the largest batch that fits, from a few more explains (the peak
grows linearly with the batch: two runs give the line, one or two confirm it).

Do not ``import funcshard.explain``: it would shadow the function ``funcshard.explain``; the
command's code is ``funcshard._pricing._explain_cli``.
"""

if __name__ == "__main__":
    import sys

    from funcshard._pricing._explain_cli import main

    sys.exit(main(usage=__doc__))
