"""Numbers computed by the authors' Optimus on the case of ``optimus_authors_case.py``.

Produced by (ChunyuanLI/Optimus, commit f3190fe, their bundled ``pytorch_transformers``; float64)::

    mkdir -p /tmp/optref && git -C /work/.mirror/ChunyuanLI+Optimus/repo archive HEAD | tar -x -C /tmp/optref
    .venv/bin/python -m tests.reference.optimus_authors --authors-dir /tmp/optref

Posterior mean and log-variance ``[3, 8]`` (row-major) as ``VAE.forward`` (``fb_mode == 1``) hands
them to ``reparameterize``, log p(x|z) per sentence with the case's noise (``-loss_rec``), the hinge
KL per sentence (``loss_kl``: dimensions with KL <= dim_target_kl = 0.5 masked out), the loss
(``loss.mean()`` of loss_rec + 0.7 * loss_kl) and, per parameter, the dot product of its gradient
(mapped to our layout) with the case's fixed random tensor. The decoder starts from ``<s>`` on both
sides (their ``<BOS>``, our ``--decoder-start bos``).
"""

AUTHORS_REFERENCE = {'mu': [1.5023735781320224,
        -0.768358146081771,
        -0.1274274350104026,
        -1.2707254519262525,
        0.8171502883609789,
        -0.18002355652609192,
        -0.550295228372761,
        0.1055171530987593,
        1.3142807552020537,
        -0.2987630774336055,
        0.14692148645279052,
        -1.0030045167859862,
        1.0629111470725576,
        -0.04079042575056005,
        -1.1613974818498543,
        -0.6918882357784507,
        1.3657480696584332,
        -0.5843281560186723,
        0.05004520704305576,
        -1.2048926541944187,
        1.105032792427965,
        -0.06273648588388459,
        -0.8844705032180354,
        -0.1450070009347085],
 'logvar': [-0.7000249997079789,
            -0.757484040717351,
            -0.5431894484901775,
            -0.7825475442623685,
            -0.49981166887841155,
            1.4344597711569058,
            0.7901873962475671,
            1.3543755988625223,
            0.14468726265260212,
            -0.7819229009887088,
            0.13487886342843114,
            -0.670865370294278,
            -0.21147113974622367,
            1.6349203555095684,
            0.8114224713979199,
            1.1100965455602003,
            -0.020482756478315545,
            -0.9851669436618979,
            -0.1390049594403222,
            -0.7591285509085711,
            -0.23200902222137132,
            1.5605584409794524,
            0.8727826134836495,
            0.9552824802603086],
 'log_px_given_z': [-30.473158145972185, -23.64956445077111, -22.037365933786393],
 'kl_hinge': [3.817339777355868, 4.882352308789882, 4.149207478038773],
 'loss': 28.384772741819617,
 'gradients': {'encoder.bert.embeddings.word_embeddings.weight': 0.48870528411827946,
               'encoder.bert.embeddings.position_embeddings.weight': 0.344365865326057,
               'encoder.bert.encoder.layer.0.attention.self.query.weight': -0.9233610227796667,
               'encoder.bert.encoder.layer.1.output.dense.weight': 3.083776270523279,
               'encoder.bert.pooler.dense.weight': 4.040450220801441,
               'encoder.posterior.weight': 2.6620807898987637,
               'decoder.memory_proj.weight': 4.626970414419598,
               'decoder.embed_proj.weight': -2.0040405144680813,
               'decoder.gpt2.transformer.wte.weight': 22.83475377730636,
               'decoder.gpt2.transformer.wpe.weight': 0.11559833897327992,
               'decoder.gpt2.transformer.h.0.attn.c_attn.weight': 0.1677396900416111,
               'decoder.gpt2.transformer.h.1.mlp.c_fc.weight': -3.98166758962312,
               'decoder.gpt2.transformer.ln_f.weight': 6.1988663388045655}}
