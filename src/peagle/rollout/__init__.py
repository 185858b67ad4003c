"""Rolling a gated candidate draft out on live traffic: canary, decision, promotion or rollback, history.

Modules: ``settings`` (the ``rollout`` and ``trigger`` run-config sections), ``live`` (live acceptance per
draft from the traffic log), ``decision`` (the decision rule and its record), ``history`` (the loop's
append-only record of refreshes, decisions and promotions), ``controller`` (the rollout procedure over a
serving backend), ``cluster`` and ``objects`` (the Kubernetes backend and its rendered objects), ``local``
(two ``peagle serve`` instances and a weighted split), ``promotion`` and ``registry`` (lineage of a promoted
draft, OpenShift AI Model Registry).
"""
