"""The commands of ``peagle`` that have parsers of their own, out of the library they call.

Each module is one command: ``build_parser()`` and ``main(argv) -> exit status``; :data:`peagle.cli.COMMANDS`
names the module ``peagle <command>`` runs. A command parses its flags, builds its configuration (the run
configuration of :mod:`peagle.run_config`, or the sections it reads) and calls the library in the domain
packages, which import no command. Command modules are entry points, as every ``__main__`` is
(docs/structure.md): above all floors, they may import anything, and only an entry point imports them.
Their ``--help`` is the docstring of the library module they run, which describes what the command does.

* :mod:`.refresh` -- ``peagle refresh`` (:mod:`peagle.refresh.steps`);
* :mod:`.gate` -- ``peagle gate`` (:mod:`peagle.gate.run`);
* :mod:`.serve` -- ``peagle serve`` (:mod:`peagle.traffic.serve`);
* :mod:`.replay` -- ``peagle replay`` (:mod:`peagle.traffic.replay`);
* :mod:`.rollout_local` -- ``peagle rollout local`` (:mod:`peagle.rollout.local`).
"""
