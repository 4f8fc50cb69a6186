"""The verbs of `paratwin`: one module per verb, each with run(cfg) over the composed config."""
