"""Numbers computed by the authors' Optimus on the case of ``optimus_authors_case.py``.

Produced by (ChunyuanLI/Optimus, commit f3190fe, their bundled ``pytorch_transformers``; float64)::

    mkdir -p /tmp/optref && git -C /work/.mirror/ChunyuanLI+Optimus/repo archive HEAD | tar -x -C /tmp/optref
    .venv/bin/python -m tests.reference.optimus_authors --authors-dir /tmp/optref

Posterior mean and log-variance ``[3, 8]`` (row-major) as ``VAE.forward`` (``fb_mode == 1``) hands
them to ``reparameterize``, log p(x|z) per sentence with the case's noise (``-loss_rec``), the hinge
KL per sentence (``loss_kl``: dimensions with KL <= dim_target_kl = 0.5 masked out), the loss
(``loss.mean()`` of loss_rec + 0.7 * loss_kl) and, per parameter, the dot product of its gradient
(mapped to our layout) with the case's fixed random tensor.
"""

AUTHORS_REFERENCE = {'mu': [1.5023735781320224,
        -0.7683581460817712,
        -0.12742743501040246,
        -1.2707254519262527,
        0.8171502883609782,
        -0.1800235565260916,
        -0.5502952283727609,
        0.10551715309875942,
        1.3142807552020537,
        -0.29876307743360553,
        0.1469214864527908,
        -1.0030045167859862,
        1.0629111470725578,
        -0.04079042575055997,
        -1.1613974818498543,
        -0.6918882357784507,
        1.3657480696584332,
        -0.5843281560186722,
        0.050045207043055984,
        -1.2048926541944187,
        1.1050327924279648,
        -0.06273648588388436,
        -0.8844705032180356,
        -0.14500700093470875],
 'logvar': [-0.700024999707979,
            -0.757484040717351,
            -0.5431894484901776,
            -0.7825475442623682,
            -0.49981166887841155,
            1.4344597711569054,
            0.7901873962475666,
            1.3543755988625223,
            0.14468726265260246,
            -0.781922900988709,
            0.13487886342843125,
            -0.670865370294278,
            -0.21147113974622356,
            1.6349203555095686,
            0.8114224713979197,
            1.1100965455602005,
            -0.020482756478315656,
            -0.9851669436618979,
            -0.13900495944032265,
            -0.7591285509085713,
            -0.23200902222137065,
            1.5605584409794524,
            0.8727826134836495,
            0.9552824802603084],
 'log_px_given_z': [-30.672279009985147, -23.746581605091162, -21.725605267789494],
 'kl_hinge': [3.817339777355868, 4.882352308789883, 4.149207478038773],
 'loss': 28.37956519259832,
 'gradients': {'encoder.bert.embeddings.word_embeddings.weight': 0.4608567697497397,
               'encoder.bert.embeddings.position_embeddings.weight': 0.8512500265016287,
               'encoder.bert.encoder.layer.0.attention.self.query.weight': -1.2654308787995443,
               'encoder.bert.encoder.layer.1.output.dense.weight': 3.145346505193562,
               'encoder.bert.pooler.dense.weight': 3.4738821430224824,
               'encoder.posterior.weight': 2.9119179900065353,
               'decoder.memory_proj.weight': 3.2812009690511315,
               'decoder.embed_proj.weight': -1.0799356445805537,
               'decoder.gpt2.transformer.wte.weight': 23.48767005786297,
               'decoder.gpt2.transformer.wpe.weight': 0.04695658163262989,
               'decoder.gpt2.transformer.h.0.attn.c_attn.weight': -0.1375009381542303,
               'decoder.gpt2.transformer.h.1.mlp.c_fc.weight': -3.5152281889440546,
               'decoder.gpt2.transformer.ln_f.weight': 6.3647416864511435}}
