"""CLIP fine-tuning under non-forgetting constraints (the paper's section 5.2).

* :mod:`.contrastive`: the two-way global contrastive objective with one MSVR estimator per
  training sample (Algorithm 2, Setting II) and :class:`ContrastiveConstrainedTrainer`;
* :mod:`.non_forgetting`: CLIP's zero-shot loss for the generic non-forgetting constraints of
  :mod:`hf_constrained.non_forgetting` (one per protected class, h_k = L_k(w) - L_k(w_old));
* :mod:`.data`: image-text / image-label rows, the collator, and the BDD100K, CSV and digits loaders;
* :mod:`.heads`: optional per-class low-rank text heads;
* :mod:`.tiny`: a small CLIP and word tokenizer built from configs (demo and tests, offline);
* :mod:`.shapes`: generated shape images, as many independent ones per class as a claim needs (the
  generated-shapes example, docs/generated_images.md); :mod:`.many_shapes`: 32 classes of them (8 shapes x 2
  sizes x 2 tones: the many-class example, docs/many_classes.md);
* :mod:`.image_task`: a small zero-shot image task: classes and prompts, augmented copies, the old model
  trained as a zero-shot classifier;
* :mod:`.protected`: the protected classes' pools with the old model's references, their values on held-out
  rows, and the replay / KL baselines that read them;
* :mod:`.experiment`: the non-forgetting experiment on such a task (the demo's pipeline: stage 1, the
  constraints, the checkpoint selection, the certificate, ``finish_run``), each run's cost by
  :mod:`hf_constrained.run_cost` (seconds and rows per step).
"""

from .contrastive import ContrastiveConstrainedTrainer, HalfPositiveSampler, contrastive_terms, gather_with_grad
from .encode import clip_embeddings
from .heads import CLIPWithClassTextHeads
from .non_forgetting import (
    NonForgettingConfig,
    NonForgettingConstraint,
    ReferenceLossDataset,
    ZeroShotCorrect,
    ZeroShotLoss,
    non_forgetting_constraints,
    reference_losses,
    zero_shot_accuracy,
)

__all__ = [
    "CLIPWithClassTextHeads",
    "ContrastiveConstrainedTrainer",
    "HalfPositiveSampler",
    "NonForgettingConfig",
    "NonForgettingConstraint",
    "ReferenceLossDataset",
    "ZeroShotCorrect",
    "ZeroShotLoss",
    "clip_embeddings",
    "contrastive_terms",
    "gather_with_grad",
    "non_forgetting_constraints",
    "reference_losses",
    "zero_shot_accuracy",
]
