"""The skip criteria a run's params ask for, beyond the non-finite check.

`from_params` builds them (their state on the current device: the
variables' device of `train_step.build_step`); the step hands them to the
guarded optimizer with any a caller passes (`build_step(criteria=...)`).
A library criterion with a flag is its module, its field in `params.py`,
its check in `param_validation.py` and its line here.
"""

from tf1_safe_train.core import spikes


def spike_config(params):
  """The run's `spikes.SpikeConfig`, or None without --skip_spikes_sigma."""
  if not params.skip_spikes_sigma:
    return None  # The graph is exactly the one without the option.
  return spikes.SpikeConfig(
      params.skip_spikes_sigma, params.spike_warmup_steps,
      params.spike_max_streak, params.skip_loss_spikes,
      dry_run=params.spike_dry_run)


def from_params(params):
  """The criteria `params` switch on (a list of `criteria.Criterion`)."""
  config = spike_config(params)
  return [spikes.SpikeDetector(config)] if config else []


def needs_loss(criteria, strategy):
  """True if the step hands its loss and towers' values to the decision
  (a criterion reads them: `Criterion.needs_loss`).

  Raises:
    ValueError: for such criteria with sync replicas (the chief decides on
      the aggregate, with no loss; --skip_loss_spikes is refused before).
  """
  needing = [c for c in criteria if c.needs_loss]
  if needing and getattr(strategy, "sync", False):
    raise ValueError("build_step: criteria %s need the loss, which sync "
                     "replicas do not give (the chief decides)" %
                     ", ".join(c.reason for c in needing))
  return bool(needing)
