"""HUBERT: tensor-product representations over BERT (Moradshahi et al., *HUBERT Untangles BERT to
Improve Transfer across NLP Tasks*, arXiv:1910.12647).

* :mod:`.head` the TPR layer (eq. 1-4, 7), aggregation (eq. 5), role orthogonality (eq. 6);
* :mod:`.model` fairseq models ``tpr_classifier`` (archs ``tpr_classifier``,
  ``tpr_classifier_lstm``) and the ``bert_lstm_classifier`` baseline;
* :mod:`.transfer` part-wise transfer and freezing from a source checkpoint (Section 4.4);
* tools (``user_dir.tools.tpr``): ``tpr-transfer-runs`` (Table 2) and ``tpr-roles-pos``
  (Section 4.5 / Figure 4).
"""

from . import model  # noqa: F401  (registers tpr_classifier, bert_lstm_classifier)
