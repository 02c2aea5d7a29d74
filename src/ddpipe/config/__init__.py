"""The whole parameter schema, and how a run's configuration is loaded and checked.

One module per part, imports running down (none imports a module above it):

    __main__   ``ddpipe config [key=value ...]``: check params.yaml (+ overrides) and print the result;
               ``--schema``: the documented schema; ``--docs``: docs/parameters.md
    command    what every command shares: load the config from its argv, exit with one line on a mistake
    load       defaults < params.yaml < ``key=value`` overrides: load_config, its messages (an unknown key with a
               did-you-mean), user_errors (a command's exit on the user's mistakes), to_yaml, schema_table
    checks     the rules that tie keys together: validate (every key's bounds and choices, then model.name,
               model.weights, data.classes, credentials, nnodes, cluster words), TORCHVISION_WEIGHTS
    rules      what one key accepts: its type, bounds and choices in words and as a check, and the one message
               shape for a value that is not accepted
    keys       every dotted key of the schema with its field (FIELDS), flatten, trajectory
    schema     the schema itself: the sections' dataclasses, Config
    param      how a field is declared (param()) and ConfigError

Nothing is imported here: ``from ddpipe.config.<module> import ...`` loads only what it names.
"""
