"""Your reward function for the worked example (docs/bring-your-own.md).

rlhf_train calls it once per batch as ``correct(prompts=[...], completions=[...], answer=[...], messages=[...])``:
``prompts`` as the policy saw them (chat template applied), ``completions`` the generated answers (text),
and every other column of the dataset (here ``answer``, and the chat ``messages``) as a keyword argument.
Return one float per completion, or None for "no reward for this one".
"""
import re


def correct(prompts, completions, answer, **columns):
    """1.0 when the first number in the completion is the dataset's answer, 0.0 for another number, and
    -0.5 when there is no number at all (a format reward folded in)."""
    out = []
    for completion, expected in zip(completions, answer):
        numbers = re.findall(r"-?\d+", completion)
        out.append(-0.5 if not numbers else float(numbers[0] == str(expected)))
    return out
