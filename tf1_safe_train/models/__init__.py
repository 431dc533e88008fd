"""Reference models, looked up by name.

Every model is a function `model_fn(images, is_training, num_classes=10)`
returning float32 logits [batch, num_classes]; it builds its variables with
`tf.compat.v1.get_variable`, so it can be called once per tower under a
reusing variable scope.
"""

from tf1_safe_train.models import resnet
from tf1_safe_train.models import small_cnn

_MODELS = {
    "small_cnn": small_cnn.small_cnn,
    "resnet20": resnet.resnet20,
    "resnet8": resnet.resnet8,
}
MODEL_NAMES = tuple(sorted(_MODELS))


def get_model(name):
  """Returns the model function called `name`.

  Args:
    name: one of `MODEL_NAMES`.

  Returns:
    The model function.

  Raises:
    ValueError: if `name` is not a known model.
  """
  try:
    return _MODELS[name]
  except (KeyError, TypeError):
    raise ValueError("unknown model %r; expected one of %s" %
                     (name, ", ".join(MODEL_NAMES))) from None
