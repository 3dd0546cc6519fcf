"""Each alternative scheduler's own headline metric, computed from finished
requests, so that every policy is judged on its paper's terms as well as on
TDG (``scheduler.tdg``): one module per paper."""
